"""`python -m experiments.bench_sim` (an entry point; the code: experiments/benchmarks/sim.py)."""

from experiments.benchmarks.sim import main

if __name__ == "__main__":
    main()
