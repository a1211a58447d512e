"""What amp says: the trace of patched calls, the overflow report and the origin watch of a skipped
step, the non-finite-loss warning (every layer reports into these, so they sit just above the
foundations), and the precision audit (`amp.audit`), which runs the others' machinery."""
