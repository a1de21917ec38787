"""The command line: ``main`` parses arguments and maps errors to exit codes in one place; each
verb group is a thin module over the library. The top layer: it may import any package.
"""
