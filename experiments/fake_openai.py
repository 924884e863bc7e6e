"""`python -m experiments.fake_openai` (an entry point; the code: experiments/serving/fake_openai.py)."""

from experiments.serving.fake_openai import main

if __name__ == "__main__":
    main()
