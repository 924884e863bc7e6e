"""Load generation against any OpenAI-compatible server (``python -m experiments.loadgen``).

``target.py`` the target section; ``prompts.py`` the prompt of each request (token ids, or text of an exact token
count); ``client.py`` the asyncio client that sends, streams and times each request; ``run.py`` the entry point that
writes the run directory.
"""
