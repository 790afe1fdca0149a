"""Qt-free core of Switchyard: everything the CLI, the GUI and the tests drive.

Nothing under this package may import Qt (an import-linter contract enforces it).
"""
