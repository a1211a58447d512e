"""What amp says: the trace of patched calls, the overflow report and the origin watch of a skipped
step, the non-finite-loss warning. Every layer reports into these, so they sit just above the
foundations; the audit, which runs the others' machinery, is amp/auditing/."""
