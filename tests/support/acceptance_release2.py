"""Release 2 of the acceptance tests' product handlers (``LEDGER_HANDLER_MODULES``; worker processes only).

The fixes for what release 1 could not process: a workspace for a checkout without
client_reference_id is named after its customer, and upcoming invoices are noticed. See acceptance_business.
"""
from tests.support import acceptance_business as business
from workers.registry import handler

handler("invoice.paid")(business.grant_credits)
handler("checkout.session.completed")(business.provision_workspace)
handler("invoice.upcoming")(business.notice_upcoming_invoice)
