"""`python -m experiments.bench_gateway` (an entry point; the code: experiments.benchmarks.gateway.py)."""

from experiments.benchmarks.gateway import main

if __name__ == "__main__":
    main()
