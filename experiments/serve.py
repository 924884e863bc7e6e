"""`python -m experiments.serve` (an entry point; the code: experiments/serving/serve.py)."""

from experiments.serving.serve import main

if __name__ == "__main__":
    main()
