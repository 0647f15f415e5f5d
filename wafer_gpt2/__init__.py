"""wafer-gpt2: GPT-2 inference served over HTTP from a Cerebras wafer (or its embedded simulator).

The sub-packages are the layers, each importing only those below it (pyproject's [tool.importlinter]):

    cli       the `wafer-gpt2` command line
    service   the HTTP API (TGI and OpenAI routes, the server, its connections)
    engine    continuous batching over one backend: scheduler, KV slots, sampling, the engine process
    backends  what runs the model: reference, sim, csl, sdk-container, sdk-appliance, null, modeled
    host      the host program (memcpy only) and the compile driver
    codegen   the CSL program generator (a plan -> layout.csl for the PE programs in kernels/)
    sim       the embedded wafer simulator
    plan      the planner: where every layer sits on the wafer and how it is tiled
    core      the wafer side's shared vocabulary: architectures, tilings, cost model, wire format, the
              program's interface with its host (abi), the runtime Protocol, the Backend contract (steps)
    model     GPT-2 itself: config, weights and their formats, tokenizer, the NumPy reference forward pass

and, below them all, `errors`, `logs`, `log_limits` and `settings`. `kernels/` holds the CSL (package
data, not Python). The CSL executor the `csl` backend runs on is a package of its own, `csl_executor`.
"""
