"""`python -m experiments.bench_gpu` (an entry point; the code: experiments/benchmarks/gpu.py)."""

from experiments.benchmarks.gpu import main

if __name__ == "__main__":
    main()
