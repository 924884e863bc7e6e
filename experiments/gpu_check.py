"""`python -m experiments.gpu_check` (an entry point; the code: experiments/benchmarks/gpu_check.py)."""

from experiments.benchmarks.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(main())
