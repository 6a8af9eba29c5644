"""Everything inside one worker: blocks, KV cache, scheduler, model runner, sampler, engine."""
