"""Diagnostics that run a user's forward through amp: the precision audit (`amp.audit`), which
measures each module in FP32 and in low precision and says what to keep in FP32."""
