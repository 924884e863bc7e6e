"""`python -m experiments.quant_quality` (an entry point; the code: experiments/studies/quant_quality.py)."""

from experiments.studies.quant_quality import main

if __name__ == "__main__":
    main()
