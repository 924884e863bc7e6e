"""`python -m experiments.bench_tp` (an entry point; the code: experiments/benchmarks/tp.py)."""

from experiments.benchmarks.tp import main

if __name__ == "__main__":
    main()
