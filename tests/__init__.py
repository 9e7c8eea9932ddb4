"""entrenar's tests, a package: test files import shared code as `from tests.helpers... import ...` (the
checkout's root is on sys.path under pytest, and child processes get it through tests.helpers.cli.child_env),
never each other through sys.path."""
