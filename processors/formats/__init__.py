"""The built-in export formats, one package each: how a folder of the format is recognised
(``detect``), read back (``reader``, written from the format's specification and never importing
the packer), packed (``packer``) and described (``config``); ``format`` binds them into the
:class:`msquant.plugin.ExportFormat` registered in the ``msquant.formats`` entry-point group. The savers
(``msquant.processors.*_saver``) build on :class:`msquant.plugin.Saver` with a format's packer and config.
"""
