"""The command lines: one parser base and one wrapper that turns an exception into one line and an
exit status, and a thin ``main()`` per command over a library function (``extract``, ``python -m
extract.probe``, ``.compare``, ``.report``, ``.verify``)."""
