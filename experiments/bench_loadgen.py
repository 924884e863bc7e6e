"""`python -m experiments.bench_loadgen` (an entry point; the code: experiments/benchmarks/loadgen.py)."""

from experiments.benchmarks.loadgen import main

if __name__ == "__main__":
    main()
