"""`python -m experiments.loadgen` (an entry point; the code: experiments/serving/loadgen/)."""

from experiments.serving.loadgen.run import main

if __name__ == "__main__":
    main()
