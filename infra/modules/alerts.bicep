// Alerts and a dashboard for every poller, queue and subscription, from dbfanout's own metrics in
// Application Insights (customMetrics, shared/telemetry.py) and Service Bus's platform metrics:
//
// - stall: no successful tick of a poller for stallIntervals schedule intervals (or no report at
//   all): dbfanout.last_success_timestamp;
// - lag: a poller's dbfanout.lag above its threshold;
// - retained WAL: a pg_logical poller's slot holds more than retainedWalThresholdBytes;
// - WAL headroom: a pg_logical poller's slot has used more than walKeepUsedPercent of
//   max_slot_wal_keep_size (PostgreSQL invalidates it at the limit, and changes are lost);
// - truncate: a pg_logical poller read a TRUNCATE of one of its tables (not delivered as an event):
//   dbfanout.truncates;
// - sink refusing: the broker has refused a poller's sends (queue full, throttled, unreachable)
//   for refusingMinutes: dbfanout.sink_refusing stayed 1;
// - dead letters: a queue's or topic's DeadletteredMessages > 0 (Service Bus metric, independent of
//   the app's telemetry), and per subscription / storage queue dbfanout.events.dead_lettered > 0;
// - a workbook: lag, throughput, commit -> handler latency, failures and dead letters per poller.
//
// Everything goes to one action group whose email address and webhook are parameters.

@description('Resource id of the Application Insights component the app exports to.')
param applicationInsightsId string

@description('Name of the Service Bus namespace (its queues and topics get dead-letter alerts).')
param serviceBusNamespaceName string

@description('Azure region of the log alert rules and the workbook.')
param location string

@description('Tags for every resource.')
param tags object = {}

@description('One entry per poller of dbfanout.toml: {name, scheduleSeconds (its schedule interval), kind (keyset, outbox or pg_logical), lagThresholdSeconds?}.')
param pollers array

@description('Service Bus queue names (the queues parameter).')
param queueNames array

@description('Service Bus topic names (the topics parameter); their subscriptions are alerted on one by one.')
param topicNames array = []

@description('Storage queue names of storage-queue pollers.')
param storageQueueNames array = []

@description('Name of the action group.')
param actionGroupName string

@description('Email address alerts go to; empty for none.')
param alertEmail string = ''

@description('Webhook (https) alerts are posted to (common alert schema); empty for none.')
param alertWebhookUri string = ''

@description('A poller stalls after this many schedule intervals without a successful tick.')
@minValue(2)
@maxValue(100)
param stallIntervals int = 5

@description('Default lag threshold in seconds (a poller may set lagThresholdSeconds).')
@minValue(1)
param lagThresholdSeconds int = 300

@description('A poller alerts once the broker has refused its sends (queue full, throttled, unreachable) for this many minutes.')
@minValue(5)
@maxValue(1440)
param refusingMinutes int = 15

@description('Retained WAL (bytes) above which a pg_logical poller alerts.')
@minValue(1048576)
param retainedWalThresholdBytes int = 1073741824

@description('Share (percent) of max_slot_wal_keep_size a pg_logical poller\'s slot may hold back before it alerts (the slot is lost at 100).')
@minValue(1)
@maxValue(99)
param walKeepUsedPercent int = 80

var emailReceivers = empty(alertEmail) ? [] : [
  {
    name: 'dbfanout-email'
    emailAddress: alertEmail
    useCommonAlertSchema: true
  }
]
var webhookReceivers = empty(alertWebhookUri) ? [] : [
  {
    name: 'dbfanout-webhook'
    serviceUri: alertWebhookUri
    useCommonAlertSchema: true
  }
]

resource actionGroup 'Microsoft.Insights/actionGroups@2023-01-01' = {
  name: actionGroupName
  location: 'global'
  tags: tags
  properties: {
    groupShortName: 'dbfanout'
    enabled: true
    emailReceivers: emailReceivers
    webhookReceivers: webhookReceivers
  }
}

resource serviceBus 'Microsoft.ServiceBus/namespaces@2024-01-01' existing = {
  name: serviceBusNamespaceName
}

// A poller stalls: its last successful tick is older than stallIntervals schedule intervals, or it
// never reported one in the last day (the union row keeps the query answering when nothing came).
resource stallAlert 'Microsoft.Insights/scheduledQueryRules@2023-03-15-preview' = [for p in pollers: {
  name: 'dbfanout-stall-${p.name}'
  location: location
  tags: tags
  kind: 'LogAlert'
  properties: {
    displayName: 'dbfanout poller ${p.name} stalled'
    description: 'No successful tick of poller ${p.name} for ${stallIntervals} schedule intervals (${stallIntervals * p.scheduleSeconds} s). Check dbfanout status ${p.name} and the poll_${p.name} function logs.'
    severity: 1
    enabled: true
    scopes: [
      applicationInsightsId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'P1D'
    criteria: {
      allOf: [
        {
          query: format('customMetrics | where name == "dbfanout.last_success_timestamp" and tostring(customDimensions.poller) == "{0}" | summarize last = max(value) | union (print last = real(null)) | summarize last = max(last) | where isnull(last) or last < datetime_diff("second", now(), datetime(1970-01-01)) - {1}', p.name, stallIntervals * p.scheduleSeconds)
          timeAggregation: 'Count'
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: true
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}]

// A poller falls behind: the age of the newest row it sent (dbfanout.lag) above the threshold.
resource lagAlert 'Microsoft.Insights/scheduledQueryRules@2023-03-15-preview' = [for p in pollers: {
  name: 'dbfanout-lag-${p.name}'
  location: location
  tags: tags
  kind: 'LogAlert'
  properties: {
    displayName: 'dbfanout poller ${p.name} lagging'
    description: 'Poller ${p.name} is more than ${contains(p, 'lagThresholdSeconds') ? p.lagThresholdSeconds : lagThresholdSeconds} s behind its source. Raise batch_size / max_batches_per_tick or look for a slow source or queue.'
    severity: 2
    enabled: true
    scopes: [
      applicationInsightsId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'PT15M'
    criteria: {
      allOf: [
        {
          query: format('customMetrics | where name == "dbfanout.lag" and tostring(customDimensions.poller) == "{0}" | summarize lag = max(valueMax) | where lag > {1}', p.name, contains(p, 'lagThresholdSeconds') ? p.lagThresholdSeconds : lagThresholdSeconds)
          timeAggregation: 'Count'
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: true
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}]

// The broker refuses a poller's sends (queue full, throttled, unreachable): the poller backs off and
// loses nothing, but delivers nothing either. dbfanout.sink_refusing is 1 while it lasts (exported
// about once a minute); every report in the last refusingMinutes being 1 is the alert.
resource refusingAlert 'Microsoft.Insights/scheduledQueryRules@2023-03-15-preview' = [for p in pollers: {
  name: 'dbfanout-refusing-${p.name}'
  location: location
  tags: tags
  kind: 'LogAlert'
  properties: {
    displayName: 'dbfanout poller ${p.name}: the broker refuses its sends'
    description: 'The broker has refused the sends of poller ${p.name} for ${refusingMinutes} minutes (reason: queue_full, throttled or unreachable in customDimensions.reason of dbfanout.sends_refused). Nothing is lost; see the operations guide, The broker refuses, and dbfanout status ${p.name}.'
    severity: 2
    enabled: true
    scopes: [
      applicationInsightsId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'PT${refusingMinutes}M'
    criteria: {
      allOf: [
        {
          query: format('customMetrics | where name == "dbfanout.sink_refusing" and tostring(customDimensions.poller) == "{0}" and timestamp > ago({1}m) | summarize low = min(valueMin), first = min(timestamp) | where low >= 1 and first < ago({2}m)', p.name, refusingMinutes, refusingMinutes - 2)
          timeAggregation: 'Count'
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: true
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}]

// A pg_logical poller's replication slot holds WAL back: the primary's disk fills if it goes on.
resource walAlert 'Microsoft.Insights/scheduledQueryRules@2023-03-15-preview' = [for p in pollers: if (p.kind == 'pg_logical') {
  name: 'dbfanout-wal-${p.name}'
  location: location
  tags: tags
  kind: 'LogAlert'
  properties: {
    displayName: 'dbfanout poller ${p.name} retains WAL'
    description: 'The replication slot of poller ${p.name} retains more than ${retainedWalThresholdBytes} bytes of WAL. A stalled poller holds the slot back: see the operations guide, Logical replication slots.'
    severity: 1
    enabled: true
    scopes: [
      applicationInsightsId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'PT15M'
    criteria: {
      allOf: [
        {
          query: format('customMetrics | where name == "dbfanout.pg_logical.retained_wal" and tostring(customDimensions.poller) == "{0}" | summarize wal = max(value) | where wal > {1}', p.name, retainedWalThresholdBytes)
          timeAggregation: 'Count'
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: true
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}]

// A pg_logical poller read a TRUNCATE of one of its tables: no event is delivered for it, so the
// targets still hold the truncated rows until someone acts (dbfanout status names the table).
resource truncateAlert 'Microsoft.Insights/scheduledQueryRules@2023-03-15-preview' = [for p in pollers: if (p.kind == 'pg_logical') {
  name: 'dbfanout-truncate-${p.name}'
  location: location
  tags: tags
  kind: 'LogAlert'
  properties: {
    displayName: 'dbfanout poller ${p.name} read a TRUNCATE'
    description: 'A table of poller ${p.name} was truncated. No event is delivered for a TRUNCATE: truncate the targets the same way, or rebuild them with dbfanout snapshot ${p.name}; dbfanout status ${p.name} names the table. See the operations guide, Logical replication slots (TRUNCATE).'
    severity: 2
    enabled: true
    scopes: [
      applicationInsightsId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'PT15M'
    criteria: {
      allOf: [
        {
          query: format('customMetrics | where name == "dbfanout.truncates" and tostring(customDimensions.poller) == "{0}" | summarize truncates = sum(valueSum) | where truncates > 0', p.name)
          timeAggregation: 'Count'
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: false
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}]

// A pg_logical poller's slot nears max_slot_wal_keep_size: at the limit PostgreSQL invalidates it and
// the changes after its position are lost (see the runbook). Used share = retained / (retained +
// headroom), from dbfanout.pg_logical.retained_wal and dbfanout.pg_logical.wal_headroom (PostgreSQL's
// safe_wal_size, reported only when max_slot_wal_keep_size is set).
resource walHeadroomAlert 'Microsoft.Insights/scheduledQueryRules@2023-03-15-preview' = [for p in pollers: if (p.kind == 'pg_logical') {
  name: 'dbfanout-wal-headroom-${p.name}'
  location: location
  tags: tags
  kind: 'LogAlert'
  properties: {
    displayName: 'dbfanout poller ${p.name} nears max_slot_wal_keep_size'
    description: 'The replication slot of poller ${p.name} holds back more than ${walKeepUsedPercent}% of max_slot_wal_keep_size. At the limit PostgreSQL invalidates the slot and the changes after its position are lost: see the operations guide, A replication slot was lost.'
    severity: 1
    enabled: true
    scopes: [
      applicationInsightsId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'PT15M'
    criteria: {
      allOf: [
        {
          query: format('customMetrics | where name in ("dbfanout.pg_logical.retained_wal", "dbfanout.pg_logical.wal_headroom") and tostring(customDimensions.poller) == "{0}" | summarize retained = maxif(value, name == "dbfanout.pg_logical.retained_wal"), headroom = minif(value, name == "dbfanout.pg_logical.wal_headroom") | where isnotnull(headroom) and retained + headroom > 0 and 100.0 * retained / (retained + headroom) > {1}', p.name, walKeepUsedPercent)
          timeAggregation: 'Count'
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: true
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}]

// Dead letters in a queue or a topic's subscriptions: the platform metric, so it fires even when
// the app's telemetry does not arrive.
resource entityDlqAlert 'Microsoft.Insights/metricAlerts@2018-03-01' = [for entity in concat(queueNames, topicNames): {
  name: 'dbfanout-dlq-${replace(entity, '/', '-')}'
  location: 'global'
  tags: tags
  properties: {
    description: 'Messages in the dead-letter queue of ${entity}. See why: dbfanout dlq peek ${entity} (for a topic: TOPIC/SUBSCRIPTION).'
    severity: 2
    enabled: true
    scopes: [
      serviceBus.id
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'PT5M'
    criteria: {
      'odata.type': 'Microsoft.Azure.Monitor.SingleResourceMultipleMetricCriteria'
      allOf: [
        {
          criterionType: 'StaticThresholdCriterion'
          name: 'dead-lettered'
          metricNamespace: 'Microsoft.ServiceBus/namespaces'
          metricName: 'DeadletteredMessages'
          dimensions: [
            {
              name: 'EntityName'
              operator: 'Include'
              values: [
                entity
              ]
            }
          ]
          operator: 'GreaterThan'
          threshold: 0
          timeAggregation: 'Maximum'
        }
      ]
    }
    autoMitigate: true
    actions: [
      {
        actionGroupId: actionGroup.id
      }
    ]
  }
}]

// Dead letters per subscription (split by the subscription dimension) and per storage queue (its
// -poison queue has no platform metric): events the workers counted as dead-lettered.
resource appDlqAlert 'Microsoft.Insights/scheduledQueryRules@2023-03-15-preview' = [for entity in concat(topicNames, storageQueueNames): {
  name: 'dbfanout-deadlettered-${replace(entity, '/', '-')}'
  location: location
  tags: tags
  kind: 'LogAlert'
  properties: {
    displayName: 'dbfanout events dead-lettered from ${entity}'
    description: 'Workers dead-lettered events received from ${entity}. See why: dbfanout dlq peek ${entity}/SUBSCRIPTION (a topic) or dbfanout dlq peek ${entity} (a storage queue).'
    severity: 2
    enabled: true
    scopes: [
      applicationInsightsId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'PT15M'
    criteria: {
      allOf: [
        {
          query: format('customMetrics | where name == "dbfanout.events.dead_lettered" and tostring(customDimensions.queue) == "{0}" | extend subscription = tostring(customDimensions.subscription) | summarize events = sum(valueSum) by subscription | where events > 0', entity)
          timeAggregation: 'Count'
          dimensions: [
            {
              name: 'subscription'
              operator: 'Include'
              values: [
                '*'
              ]
            }
          ]
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: false
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}]

var workbookContent = {
  version: 'Notebook/1.0'
  items: [
    {
      type: 1
      name: 'title'
      content: {
        json: '## dbfanout\nPer poller: lag, throughput, commit -> handler latency, failures and dead letters (dbfanout metrics in customMetrics; names in docs/operations.md, section 6). Latency percentiles are over the exporter\'s per-minute aggregates (Azure Monitor keeps a histogram as count, sum, min and max): p50 of the per-minute means, p99 of the per-minute maxima.'
      }
    }
    {
      type: 3
      name: 'last-success'
      content: {
        version: 'KqlItem/1.0'
        title: 'Last successful tick per poller'
        query: 'customMetrics | where name == "dbfanout.last_success_timestamp" | summarize last = max(value) by poller = tostring(customDimensions.poller) | extend last_success = unixtime_seconds_todatetime(last), age_seconds = datetime_diff("second", now(), unixtime_seconds_todatetime(last)) | project poller, last_success, age_seconds | order by age_seconds desc'
        size: 1
        queryType: 0
        resourceType: 'microsoft.insights/components'
        visualization: 'table'
      }
    }
    {
      type: 3
      name: 'lag'
      content: {
        version: 'KqlItem/1.0'
        title: 'Lag (seconds) per poller'
        query: 'customMetrics | where name == "dbfanout.lag" | summarize lag = max(valueMax) by bin(timestamp, 5m), poller = tostring(customDimensions.poller) | render timechart'
        size: 0
        queryType: 0
        resourceType: 'microsoft.insights/components'
        visualization: 'timechart'
      }
    }
    {
      type: 3
      name: 'lag-rows'
      content: {
        version: 'KqlItem/1.0'
        title: 'Rows behind per poller (keyset and outbox; counted up to 10,000)'
        query: 'customMetrics | where name == "dbfanout.lag_rows" | summarize rows = max(valueMax) by bin(timestamp, 5m), poller = tostring(customDimensions.poller) | render timechart'
        size: 0
        queryType: 0
        resourceType: 'microsoft.insights/components'
        visualization: 'timechart'
      }
    }
    {
      type: 3
      name: 'throughput'
      content: {
        version: 'KqlItem/1.0'
        title: 'Events handled per minute, per poller'
        query: 'customMetrics | where name == "dbfanout.events_handled" | summarize events = sum(valueSum) by bin(timestamp, 1m), poller = tostring(customDimensions.poller) | render timechart'
        size: 0
        queryType: 0
        resourceType: 'microsoft.insights/components'
        visualization: 'timechart'
      }
    }
    {
      type: 3
      name: 'latency'
      content: {
        version: 'KqlItem/1.0'
        title: 'Commit -> handler latency (seconds): p50 and p99 per poller'
        query: 'customMetrics | where name == "dbfanout.commit_to_handler" and valueCount > 0 | extend poller = tostring(customDimensions.poller), mean = valueSum / valueCount | summarize p50 = percentile(mean, 50), p99 = percentile(valueMax, 99) by bin(timestamp, 5m), poller | render timechart'
        size: 0
        queryType: 0
        resourceType: 'microsoft.insights/components'
        visualization: 'timechart'
      }
    }
    {
      type: 3
      name: 'failures'
      content: {
        version: 'KqlItem/1.0'
        title: 'Failures per poller: failed deliveries, poller failures by stage, sends the broker refused by reason'
        query: 'customMetrics | where name in ("dbfanout.deliveries.failed", "dbfanout.failures", "dbfanout.sends_refused") | extend poller = tostring(customDimensions.poller), what = case(name == "dbfanout.failures", strcat("tick:", tostring(customDimensions.stage)), name == "dbfanout.sends_refused", strcat("refused:", tostring(customDimensions.reason)), "delivery") | summarize failures = sum(valueSum) by bin(timestamp, 5m), series = strcat(poller, " ", what) | render timechart'
        size: 0
        queryType: 0
        resourceType: 'microsoft.insights/components'
        visualization: 'timechart'
      }
    }
    {
      type: 3
      name: 'why-failed'
      content: {
        version: 'KqlItem/1.0'
        title: 'Why deliveries failed: the latest 100, with the exception (scrubbed) each handler raised'
        query: 'requests | where name == "dbfanout.deliver" and success == false | extend poller = tostring(customDimensions["dbfanout.poller"]), queue = tostring(customDimensions["messaging.destination.name"]), subscription = tostring(customDimensions["dbfanout.subscription"]), message_id = tostring(customDimensions["messaging.message.id"]), delivery = toint(customDimensions["dbfanout.delivery_count"]) | join kind=leftouter (exceptions | project span_id = operation_ParentId, error = type, reason = outerMessage) on $left.id == $right.span_id | project timestamp, poller, queue, subscription, message_id, delivery, error, reason | order by timestamp desc | take 100'
        size: 1
        queryType: 0
        resourceType: 'microsoft.insights/components'
        visualization: 'table'
      }
    }
    {
      type: 3
      name: 'dead-letters'
      content: {
        version: 'KqlItem/1.0'
        title: 'Dead-lettered events per poller, queue and subscription (why: dbfanout dlq peek ENTITY)'
        query: 'customMetrics | where name == "dbfanout.events.dead_lettered" | summarize events = sum(valueSum) by poller = tostring(customDimensions.poller), queue = tostring(customDimensions.queue), subscription = tostring(customDimensions.subscription) | order by events desc'
        size: 1
        queryType: 0
        resourceType: 'microsoft.insights/components'
        visualization: 'table'
      }
    }
  ]
  fallbackResourceIds: [
    applicationInsightsId
  ]
}

resource workbook 'Microsoft.Insights/workbooks@2022-04-01' = {
  name: guid(resourceGroup().id, applicationInsightsId, 'dbfanout-workbook')
  location: location
  tags: tags
  kind: 'shared'
  properties: {
    displayName: 'dbfanout pipeline'
    category: 'workbook'
    sourceId: applicationInsightsId
    serializedData: string(workbookContent)
  }
}

output actionGroupId string = actionGroup.id
output workbookId string = workbook.id
