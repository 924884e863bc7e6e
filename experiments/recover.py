"""`python -m experiments.recover` (an entry point; the code: experiments/serving/recover.py)."""

from experiments.serving.recover import main

if __name__ == "__main__":
    raise SystemExit(main())
