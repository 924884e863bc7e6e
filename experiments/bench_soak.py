"""`python -m experiments.bench_soak` (an entry point; the code: experiments/benchmarks/soak.py)."""

from experiments.benchmarks.soak import main

if __name__ == "__main__":
    main()
