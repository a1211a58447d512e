"""What amp keeps of apex for code written against it: apex's `amp._amp_state`, optimizer
wrappers such as apex's LARC, and which `apex` an `import apex` would give. (The installable
`apex` package itself is compat/apex at the repository's top.)"""
