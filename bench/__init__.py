"""entrenar's benchmark suite (`python -m bench --list`) and the measurement modules it runs.

bench/ is a package: its modules import each other as `bench.x`, run from the checkout's root
(`python -m bench ...`, `python -m bench.train_throughput ...`)."""
