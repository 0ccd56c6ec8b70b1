Feature: A worker killed in the middle of processing leaves no partial effect
  A worker's business writes and the ledger's "processed" mark are committed
  together. A worker killed between them (SIGKILL: no clean-up at all) leaves neither
  behind; the retry finds no trace of the interrupted attempt and the business effect
  happens exactly once.

  Scenario Outline: A worker killed after its business write, before the ledger records the event processed
    Given worker leases last 10 seconds
    And the worker will stall after its business write, before recording the event processed
    When Stripe delivers an invoice.paid event
    And the worker process is killed with SIGKILL while it holds its uncommitted business write
    Then no credits are visible and the event still shows the dead worker's attempt in progress
    When <rescue> after the dead worker's lease expired
    Then processing is attempted again by another process
    And the credits for the invoice are granted exactly once
    And the invoice is recorded paid, once
    And the event ends processed

    Examples:
      | rescue                          |
      | Stripe delivers the event again |
      | the recovery sweep runs         |
