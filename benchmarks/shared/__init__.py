"""What every benchmark uses: workloads, the report, the machine, the --quick model, a server
process, step timers. Imports no other kind of benchmark."""
