"""O1 and regions: the patch ledger, the wrappers and casts that run each op in its table's dtype,
torch's autocast surface answered from amp's state, autocast regions, registration and trace."""
