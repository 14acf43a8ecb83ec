"""One module per ``ckpttool`` command: parse options, call one library function, render its result."""
