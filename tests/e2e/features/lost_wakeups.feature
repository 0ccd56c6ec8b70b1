Feature: An event whose wake-up was lost is recovered by the sweep
  The broker only carries wake-ups; the ledger in Postgres is the truth. An event
  acknowledged while the broker was unreachable is not lost: the recovery sweep
  re-drives it and it is processed, once.

  Scenario: An event received while the broker is down is processed after the recovery sweep
    Given the receiver cannot reach the broker
    When Stripe delivers an invoice.paid event
    Then Stripe's delivery is acknowledged as received, without waking a worker
    And the event is waiting as received, with nothing applied
    When the operator runs the recovery sweep, ledgerctl sweep
    Then the event ends processed
    And the credits for the invoice are granted exactly once
