"""The executor's stand-ins for the Cerebras SDK's host modules (see csl_executor/sdk.py).

`csl-executor cs_python` puts the folder above this package first on `sys.path`, so that a csl-examples
`run.py` imports them under the SDK's own names. Nothing else imports them."""
