"""`python -m experiments.gateway` (an entry point; the code: experiments/serving/gateway/main.py)."""

from experiments.serving.gateway.main import main

if __name__ == "__main__":
    main()
