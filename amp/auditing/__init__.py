"""The precision audit (`amp.audit`): a forward run in FP32 and in low precision, module by module,
and the report of where low precision loses. It runs the machinery of the layers below (casting's
regions, scaling's default scale, diagnostics' origin watch), so it stands above them."""
