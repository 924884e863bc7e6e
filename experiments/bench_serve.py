"""`python -m experiments.bench_serve` (an entry point; the code: experiments/benchmarks/serve.py)."""

from experiments.benchmarks.serve import main

if __name__ == "__main__":
    main()
