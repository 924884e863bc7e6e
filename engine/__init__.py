"""The real engine: Llama-family model over a paged KV cache, weights loader, sampler, model runner, executor.

Import the submodules directly (``engine.executor.build_engine_executor``, ``engine.loader.load_model``);
this package imports nothing eagerly so ``import engine`` stays cheap.
"""
