Feature: A failed attempt is completed later, and its business effect happens exactly once
  Stripe delivers every event at least once, in any order. When processing an event
  fails before it completes, nothing of the failed attempt is kept, and the event is
  attempted again, on Stripe's retry or on our own, until its business effect has
  happened exactly once.

  Here the business effect is the credits granted for a paid invoice, and the failure
  is a real Postgres error (a serialization failure) raised by the credits write.

  Scenario: Stripe's retry completes an event whose processing failed
    Given the ledger's own retries wait up to an hour
    And the credits database rejects writes with a serialization failure
    And an invoice.paid event is recorded
    And processing fails before completion
    And the credits database has recovered
    When Stripe retries the same event
    Then processing is attempted again
    And the credits for the invoice are granted exactly once
    And the event ends processed

  Scenario: Our own backoff completes an event whose processing failed, without any redelivery
    Given the ledger retries failed attempts within a second
    And the credits database rejects writes with a serialization failure
    And an invoice.paid event is recorded
    And processing fails before completion
    When the credits database has recovered
    Then processing is attempted again
    And the credits for the invoice are granted exactly once
    And the event ends processed
    And Stripe delivered the event only once
