"""An example splitedge plug-in (docs/plugins.md): a method (method.py) and a model (model.py).

Nothing here is imported until a node is asked for `fedavg-ls` or `mobilenet-tiny`; the
package's entry points (pyproject.toml) are how splitedge finds them."""
