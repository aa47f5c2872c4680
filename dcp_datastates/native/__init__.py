"""The native engine's Python face (the C++ extension is ``dcp_datastates._engine``)."""
