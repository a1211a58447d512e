"""The apex package's tests need it installed: `make test` installs it; a bare `pip install -e .`
does not, and a skip would hide that 80 tests did not run."""

try:
    import apex  # noqa: F401
except ImportError as error:
    raise ImportError(
        "tests/apex_package needs amp's apex package: pip install -e ./compat/apex"
    ) from error
