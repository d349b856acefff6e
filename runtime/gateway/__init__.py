"""The data-plane gateway: API keys, quotas, routing (built in a later issue).

Like runtime.engine it may never import Django or the control-plane apps: the import-linter
contract in pyproject.toml already covers this package, so the rule holds from its first line.
"""
