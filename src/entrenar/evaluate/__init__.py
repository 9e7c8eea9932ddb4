"""Task evaluation: does the model do the task? (`entrenar eval --task humaneval`)

tasks.py (problems, prompts, code extraction, pass@k), sandbox.py (running untrusted programs),
harness.py (generate -> test -> score, with any generator), commands.py (the eval options and command).
"""
