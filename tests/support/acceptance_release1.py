"""Release 1 of the acceptance tests' product handlers (``LEDGER_HANDLER_MODULES``; worker processes only).

Credits for paid invoices; workspaces for completed checkouts, strictly by
client_reference_id; no handler for invoice.upcoming. See acceptance_business.
"""
from tests.support import acceptance_business as business
from workers.registry import handler

handler("invoice.paid")(business.grant_credits)
handler("checkout.session.completed")(business.provision_workspace_strict)
