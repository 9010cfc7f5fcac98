// dbfanout on Azure: a Flex Consumption function app (timer pollers + Service Bus queue and
// subscription workers), its storage (host, deployment package, `db-state` state blobs), a Service
// Bus namespace with one duplicate-detecting queue per queue poller and one duplicate-detecting
// topic, with one subscription per handler, per topic poller, monitoring, an optional Key Vault for
// database URLs, and least-privilege role assignments for one user-assigned managed identity.
//
// Deploy with `azd up` (azure.yaml) or `az deployment group create` (docs/deploy.md). Checked
// offline by `infra/validate.py` (tree-sitter-bicep syntax + checkov with the checks in
// infra/checks). Keep to syntax both parsers read: no user-defined types, imports, typed array
// parameters, spread or lambdas.

targetScope = 'resourceGroup'

@minLength(1)
@maxLength(64)
@description('Environment name (azd sets it); seeds resource names and the azd-env-name tag.')
param environmentName string

@description('Azure region for every resource; it must offer Flex Consumption.')
param location string = resourceGroup().location

@description('Object id of a developer (or CI principal) that also gets the data roles; empty for none. azd fills AZURE_PRINCIPAL_ID.')
param principalId string = ''

@description('Type of principalId.')
@allowed([
  'User'
  'Group'
  'ServicePrincipal'
])
param principalType string = 'User'

@description('One Service Bus queue per poller: {name, maxDeliveryCount?, lockDuration?, requiresSession?, duplicateDetectionHistoryTimeWindow?, defaultMessageTimeToLive?}. The names must match queue = ... in dbfanout.toml.')
param queues array

@description('One Service Bus topic per topic poller: {name, duplicateDetectionHistoryTimeWindow?, defaultMessageTimeToLive?, subscriptions: [{name, maxDeliveryCount?, lockDuration?, requiresSession?, filter?, defaultMessageTimeToLive?}]}. The names must match topic = ... and [pollers.X.subscriptions.NAME] in dbfanout.toml, filter = its filter exactly: the $Default rule of each subscription is built from name and filter (docs/deploy.md).')
param topics array = []

@description('Duplicate detection window for queues and topics that do not set one. It must cover lease_ttl_seconds + one schedule interval + one tick, with margin (modules/servicebus.bicep, docs/deploy.md). PT10M suits lease_ttl_seconds = 120.')
param duplicateDetectionHistoryTimeWindow string = 'PT10M'

@description('Service Bus tier: Standard (256 KB messages) or Premium. Basic is not offered: it has neither duplicate detection nor topics.')
@allowed([
  'Standard'
  'Premium'
])
param serviceBusSku string = 'Standard'

@description('Messaging units when serviceBusSku is Premium.')
@allowed([
  1
  2
  4
  8
  16
])
param serviceBusPremiumCapacity int = 1

@description('Flex Consumption instance memory in MB.')
@allowed([
  512
  2048
  4096
])
param instanceMemoryMB int = 2048

@description('Flex Consumption maximum instance count.')
@minValue(1)
@maxValue(1000)
param maximumInstanceCount int = 40

@description('Python version of the function app.')
@allowed([
  '3.11'
  '3.12'
  '3.13'
])
param pythonVersion string = '3.11'

@description('Blob container for dbfanout state ([app] state_container in dbfanout.toml).')
param stateContainerName string = 'db-state'

@description('Days claim-check blobs (oversize rows) are kept before the lifecycle rule deletes them; longer than your dead-letter retention.')
@minValue(1)
@maxValue(3650)
param claimRetentionDays int = 30

@description('Path of the config file relative to the app root (app setting DBFANOUT_CONFIG).')
param configPath string = 'dbfanout.toml'

@description('Some poller uses transport = "storage-queue": grant Storage Queue Data Contributor and set DBFANOUT_STATE__queueServiceUri.')
param useStorageQueues bool = false

@description('Queue names of the pollers with transport = "storage-queue" (created with their -poison queues when useStorageQueues is true).')
param storageQueueNames array = []

@description('Deploy a Key Vault (RBAC mode) for database URLs and let the app read its secrets.')
param deployKeyVault bool = true

@description('Purge protection on the Key Vault (recommended; keeps the vault name taken for 90 days after deletion).')
param keyVaultEnablePurgeProtection bool = true

@description('Appended to the Key Vault name (kv-<token><suffix>): change it to re-create an environment whose deleted vault still holds the name (purge protection keeps it for 90 days; `azd down --purge` cannot purge it). azd fills DBFANOUT_KEY_VAULT_SUFFIX; empty for none.')
@maxLength(8)
param keyVaultNameSuffix string = ''

@description('Database URL app settings as Key Vault references: [{name: "ORDERS_DB_URL", secretName: "orders-db-url"}] for a secret in the deployed vault, or [{name, keyVaultSecretUri}] for any vault (grant the identity Key Vault Secrets User there).')
param databaseUrlSettings array = []

@secure()
@description('Secrets to write into the deployed vault: {"orders-db-url": "<SQLAlchemy URL>"}. Needs deployKeyVault.')
param databaseUrlSecrets object = {}

@secure()
@description('Database URL app settings as plain values from this secure parameter (no Key Vault): {"ORDERS_DB_URL": "<SQLAlchemy URL>"}.')
param databaseUrlValues object = {}

@description('Further non-secret app settings: {"NAME": "value"}.')
param additionalAppSettings object = {}

@description('One entry per poller of dbfanout.toml, for its alerts: {name, scheduleSeconds (the interval of its schedule), kind (keyset, outbox or pg_logical), lagThresholdSeconds?}. The offline gate checks every configured poller has one.')
param pollers array = []

@description('Email address that alerts go to (stall, lag, retained WAL, dead letters); empty for none.')
param alertEmail string = ''

@description('Webhook (https) that alerts are posted to, common alert schema; empty for none.')
param alertWebhookUri string = ''

@description('A poller is stalled after this many schedule intervals without a successful tick.')
@minValue(2)
@maxValue(100)
param stallIntervals int = 5

@description('Lag (seconds) above which a poller alerts, unless its pollers entry sets lagThresholdSeconds.')
@minValue(1)
param lagThresholdSeconds int = 300

@description('Retained WAL (bytes) above which a pg_logical poller alerts.')
@minValue(1048576)
param retainedWalThresholdBytes int = 1073741824

@description('Share (percent) of max_slot_wal_keep_size a pg_logical poller\'s slot may hold back before it alerts.')
@minValue(1)
@maxValue(99)
param walKeepUsedPercent int = 80

@description('Function app name; empty for a generated one.')
param functionAppName string = ''

@description('Tags for every resource (azd-env-name is added).')
param tags object = {}

var resourceToken = toLower(uniqueString(subscription().id, resourceGroup().id, location, environmentName))
var allTags = union(tags, {
  'azd-env-name': environmentName
})
var appName = empty(functionAppName) ? 'func-${resourceToken}' : toLower(functionAppName)
var deploymentContainerName = 'app-package-${take(appName, 32)}-${take(resourceToken, 7)}'
var keyVaultName = toLower('kv-${resourceToken}${keyVaultNameSuffix}')
var keyVaultUri = 'https://${keyVaultName}${environment().suffixes.keyvaultDns}/'
var queueNames = [for q in queues: q.name]
var topicNames = [for t in topics: t.name]

module identity './modules/identity.bicep' = {
  name: 'identity'
  params: {
    name: 'id-${resourceToken}'
    location: location
    tags: allTags
  }
}

module storage './modules/storage.bicep' = {
  name: 'storage'
  params: {
    name: 'st${resourceToken}'
    location: location
    tags: allTags
    deploymentContainerName: deploymentContainerName
    stateContainerName: stateContainerName
    claimRetentionDays: claimRetentionDays
    storageQueueNames: useStorageQueues ? storageQueueNames : []
  }
}

module serviceBus './modules/servicebus.bicep' = {
  name: 'servicebus'
  params: {
    name: 'sb-${resourceToken}'
    location: location
    tags: allTags
    sku: serviceBusSku
    premiumCapacity: serviceBusPremiumCapacity
    queues: queues
    topics: topics
    duplicateDetectionHistoryTimeWindow: duplicateDetectionHistoryTimeWindow
  }
}

module monitoring './modules/monitoring.bicep' = {
  name: 'monitoring'
  params: {
    logAnalyticsName: 'log-${resourceToken}'
    applicationInsightsName: 'appi-${resourceToken}'
    location: location
    tags: allTags
  }
}

module alerts './modules/alerts.bicep' = {
  name: 'alerts'
  params: {
    applicationInsightsId: monitoring.outputs.applicationInsightsId
    serviceBusNamespaceName: serviceBus.outputs.name
    location: location
    tags: allTags
    pollers: pollers
    queueNames: queueNames
    topicNames: topicNames
    storageQueueNames: useStorageQueues ? storageQueueNames : []
    actionGroupName: 'ag-${resourceToken}'
    alertEmail: alertEmail
    alertWebhookUri: alertWebhookUri
    stallIntervals: stallIntervals
    lagThresholdSeconds: lagThresholdSeconds
    retainedWalThresholdBytes: retainedWalThresholdBytes
    walKeepUsedPercent: walKeepUsedPercent
  }
}

module keyVault './modules/keyvault.bicep' = if (deployKeyVault) {
  name: 'keyvault'
  params: {
    name: keyVaultName
    location: location
    tags: allTags
    enablePurgeProtection: keyVaultEnablePurgeProtection
    secrets: databaseUrlSecrets
  }
}

module appRoles './modules/rbac.bicep' = {
  name: 'rbac-app'
  params: {
    principalId: identity.outputs.principalId
    principalType: 'ServicePrincipal'
    storageAccountName: storage.outputs.name
    stateContainerName: storage.outputs.stateContainerName
    useStorageQueues: useStorageQueues
    serviceBusNamespaceName: serviceBus.outputs.name
    queueNames: queueNames
    topics: topics
    applicationInsightsName: monitoring.outputs.applicationInsightsName
    grantKeyVault: deployKeyVault
    keyVaultName: keyVaultName
  }
  dependsOn: [
    keyVault
  ]
}

module developerRoles './modules/rbac.bicep' = if (!empty(principalId)) {
  name: 'rbac-developer'
  params: {
    principalId: principalId
    principalType: principalType
    storageAccountName: storage.outputs.name
    stateContainerName: storage.outputs.stateContainerName
    useStorageQueues: useStorageQueues
    serviceBusNamespaceName: serviceBus.outputs.name
    queueNames: queueNames
    topics: topics
    applicationInsightsName: monitoring.outputs.applicationInsightsName
    grantKeyVault: deployKeyVault
    keyVaultName: keyVaultName
    keyVaultSecretsWriter: true
  }
  dependsOn: [
    keyVault
  ]
}

module functionApp './modules/function-app.bicep' = {
  name: 'function-app'
  params: {
    name: appName
    planName: 'plan-${resourceToken}'
    location: location
    tags: allTags
    serviceName: 'api'
    identityId: identity.outputs.id
    identityClientId: identity.outputs.clientId
    storageBlobEndpoint: storage.outputs.blobEndpoint
    storageQueueEndpoint: storage.outputs.queueEndpoint
    deploymentContainerName: storage.outputs.deploymentContainerName
    serviceBusFullyQualifiedNamespace: serviceBus.outputs.fullyQualifiedNamespace
    applicationInsightsConnectionString: monitoring.outputs.connectionString
    instanceMemoryMB: instanceMemoryMB
    maximumInstanceCount: maximumInstanceCount
    pythonVersion: pythonVersion
    configPath: configPath
    useStorageQueues: useStorageQueues
    keyVaultUri: deployKeyVault ? keyVaultUri : ''
    databaseUrlSettings: databaseUrlSettings
    databaseUrlValues: databaseUrlValues
    additionalAppSettings: additionalAppSettings
  }
  // Roles first, so the first start (and the first deployment) finds its storage, queues and secrets.
  dependsOn: [
    appRoles
  ]
}

// Outputs become azd environment values. None carries a secret or a database URL.
output AZURE_LOCATION string = location
output AZURE_TENANT_ID string = tenant().tenantId
output SERVICE_API_NAME string = functionApp.outputs.name
output AZURE_FUNCTION_APP_NAME string = functionApp.outputs.name
output AZURE_MANAGED_IDENTITY_CLIENT_ID string = identity.outputs.clientId
output AZURE_MANAGED_IDENTITY_PRINCIPAL_ID string = identity.outputs.principalId
output AZURE_STORAGE_ACCOUNT_NAME string = storage.outputs.name
output DBFANOUT_STATE_BLOB_SERVICE_URI string = storage.outputs.blobEndpoint
output DBFANOUT_STATE_CONTAINER string = storage.outputs.stateContainerName
output DBFANOUT_SERVICEBUS_NAMESPACE string = serviceBus.outputs.fullyQualifiedNamespace
output AZURE_SERVICEBUS_NAMESPACE_NAME string = serviceBus.outputs.name
output AZURE_KEY_VAULT_NAME string = deployKeyVault ? keyVaultName : ''
output AZURE_KEY_VAULT_URI string = deployKeyVault ? keyVaultUri : ''
output APPLICATIONINSIGHTS_NAME string = monitoring.outputs.applicationInsightsName
