"""What the methods share, by family: the shared scorers (``scorers``) and one module per family
for its bases and machinery. Nothing here is a method: discovery
(kvlab.compression.discovery.discover) imports only the modules of kvlab/methods itself, not its
subpackages, and a method imports these, never a sibling method. Importing this package runs nothing.
"""
