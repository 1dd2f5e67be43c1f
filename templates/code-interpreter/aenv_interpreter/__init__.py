"""The code-interpreter service of aenv's ``code-interpreter`` template.

It runs inside the sandbox on the image's own ``python3`` (standard library only, Python 3.9+)
and speaks the HTTP protocol of the official ``e2b-code-interpreter`` SDK on port 49999:
``POST /execute`` streams a cell's stdout, stderr, results and error as JSON lines, and
``/contexts`` creates, lists, restarts and removes the kernels cells run in. Each context is a
kernel of its own (``aenv_interpreter.kernel``), a Python process keeping the cell's namespace,
so a sandbox's pause, resume and fork keep every variable, as they keep every process.
"""

PORT = 49999
