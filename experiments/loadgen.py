"""`python -m experiments.loadgen` (an entry point; the code: experiments/serving/loadgen.py)."""

from experiments.serving.loadgen import main

if __name__ == "__main__":
    main()
