"""`python -m experiments.bench_engine` (an entry point; the code: experiments/benchmarks/engine.py)."""

from experiments.benchmarks.engine import main

if __name__ == "__main__":
    main()
