"""decompax.bin: the binaries and all process policy.

One module of absl flags and `main` per binary, each with its launcher
`bin/<name>` and `./dev <name>` verb, and what a program decides for its
process: signals, threads, child processes, priorities, the console,
checkpoint cadence, the figures drawn off the loop and device-memory checks.
Imports anything; nothing imports `bin`.
"""
