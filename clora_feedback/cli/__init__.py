"""The `clora` command line: one module per command family (`main` parses and dispatches).

Not here: the work itself; every command hands typed settings to the component that does it.
"""
