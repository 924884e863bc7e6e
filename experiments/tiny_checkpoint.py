"""`python -m experiments.tiny_checkpoint` (an entry point; the code: experiments/benchmarks/tiny_checkpoint.py)."""

from experiments.benchmarks.tiny_checkpoint import main

if __name__ == "__main__":
    main()
