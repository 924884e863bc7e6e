"""`python -m experiments.bench_moe` (an entry point; the code: experiments/benchmarks/moe.py)."""

from experiments.benchmarks.moe import main

if __name__ == "__main__":
    main()
