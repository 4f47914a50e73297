"""batchwire's benchmarks (`batchwire bench`, __main__.py), by kind:

  shared/       what every benchmark uses: workloads, the report (table, JSON, chart), the machine
                they ran on, the tiny --quick model, a `batchwire serve` process, step timers
  serving/      a server under load: the gRPC and OpenAI load generators, serving metrics
  offline/      the offline engine (LLM): throughput against its peers, prefix caching,
                speculative decoding, structured output, embeddings, pipeline parallelism
  engine/       a step's own cost apart from the model: scheduler, runner, transports,
                engine overhead, CPU attention, the n-gram proposer
  reliability/  long and hostile runs: soak, chaos
  gpu/          scripts for a CUDA machine: the Triton kernels and the worker

shared/ imports no other kind; a kind imports shared/, its own package, and serving/ where it
drives a server (tests/benchmarks/test_import_rules.py holds these rules).
"""
