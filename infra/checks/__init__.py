"""dbfanout's own checkov checks (loaded with --external-checks-dir infra/checks)."""
