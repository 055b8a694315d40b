"""The rank side of the live runtime: what runs inside a worker process. Today its tie to
the controller (``controller_link``); it meets the control side only through
``runtime.protocol``."""
