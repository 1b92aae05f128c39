"""Model families, one folder each (``kern.models.<family>``: its config fields and tensors,
torch-free; its model; its tiny checkpoint writer; its page kind where it has its own), the
layers they share (``layers``), the page kinds (``pages``), the common config (``config``) and
the registry that says what each family is and can do (``registry``). Importing this package
imports no torch: the registry names models and page kinds lazily."""
