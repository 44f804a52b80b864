"""Verifiers: a finished response checked against its row's reference (docs/verifiers.md). A verifier answers yes or
no, and only for a finished response; its verdict (`Verdict`) says why not where it is no."""
